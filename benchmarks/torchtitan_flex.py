"""torchtitan's trainer with ditron's passes installed in Inductor's config: the recipe for
torchtitan's FlexAttention models compiled with backend "inductor" (torchtitan 0.3.0 compiles
them only with "inductor" or "aot_eager", so `--compile.backend ditron` is refused there).

torchtitan 0.2.x (runs on torch 2.11; FlexAttention is the `debugmodel_flex_attn` flavor):

    TORCH_LOGS=ditron torchrun --nproc-per-node 1 -m benchmarks.torchtitan_flex \\
        --model.name llama3 --model.flavor debugmodel_flex_attn --compile.enable \\
        --training.steps 8 --model.hf_assets_path PATH/TO/torchtitan/tests/assets/tokenizer

torchtitan 0.3.0 (needs a torch newer than 2.11; FlexAttention is Llama 3's default):

    TORCH_LOGS=ditron torchrun --nproc-per-node 1 -m benchmarks.torchtitan_flex \\
        --module llama3 --config llama3_debugmodel --compile.enable --training.steps 8 \\
        --hf_assets_path PATH/TO/torchtitan/tests/assets/tokenizer

The arguments after the script's are torchtitan's (`torchtitan.train`); the script only calls
`ditron_inductor.install()` first, then the trainer's `main` (0.2.x takes the `Trainer` class,
0.3.0 nothing). Where this machine cannot reach a data set (no network) or lacks a package
torchtitan imports but this run does not use, `--synthetic-data` stands in for them:
`datasets.load_dataset` returns generated text (torchtitan's own tokenizer and dataloader still
tokenize and pack it) and TensorBoard's writer, which the run leaves off, is a stub.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import sys
import types


def _synthetic_text(samples: int = 4096, words: int = 400, seed: int = 0) -> list[dict]:
    """Sentences of random lower-case words, as a c4-like split of {"text": ...} records."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]
    return [{"text": " ".join(rng.choice(vocab) for _ in range(words)) + "."}
            for _ in range(samples)]


def _stand_ins() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        board = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:  # torchtitan builds one only with --metrics.enable_tensorboard
            def __init__(self, *args, **kwargs):
                raise RuntimeError("tensorboard is not installed")

        board.SummaryWriter = SummaryWriter
        sys.modules["torch.utils.tensorboard"] = board
    datasets = types.ModuleType("datasets")
    distributed = types.ModuleType("datasets.distributed")

    class Dataset:  # no record list is one: torchtitan iterates it from the start
        pass

    datasets.Dataset = Dataset
    datasets.load_dataset = lambda *args, **kwargs: _synthetic_text()
    distributed.split_dataset_by_node = lambda data, rank, world_size: data[rank::world_size]
    datasets.distributed = distributed
    sys.modules["datasets"] = datasets
    sys.modules["datasets.distributed"] = distributed


def main() -> None:
    if "--synthetic-data" in sys.argv:
        sys.argv.remove("--synthetic-data")
        _stand_ins()
    import ditron_inductor

    ditron_inductor.install()
    from torchtitan import train

    if inspect.signature(train.main).parameters:  # 0.2.x: main(trainer_class)
        train.main(train.Trainer)
    else:  # 0.3.0
        train.main()


if __name__ == "__main__":
    main()
