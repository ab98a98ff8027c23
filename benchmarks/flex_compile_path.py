"""torchtitan's compile path in miniature, on one GPU: a FlexAttention transformer (torchtitan's
Llama 3 debug model's sizes: dim 256, 16 heads, 6 blocks, vocabulary 2048, S 2048, B 8) whose
blocks are compiled as torchtitan compiles them (`block.compile(backend="inductor",
fullgraph=True)`), with ditron's passes installed in Inductor's config by
`ditron_inductor.install()`; 8 AdamW steps on random tokens under bf16 autocast.

    TORCH_LOGS=ditron python -m benchmarks.flex_compile_path

The stand-in for `benchmarks/torchtitan_flex.py` (torchtitan's own trainer) where torchtitan
does not run; at TP 1 the log says, per graph, that there is nothing to fuse.
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ditron_inductor

ditron_inductor.install()
D, H, S, B, L, V = 256, 16, 2048, 8, 6, 2048


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(D, 3 * D, bias=False)
        s.o = nn.Linear(D, D, bias=False)
        s.up = nn.Linear(D, 4 * D, bias=False)
        s.down = nn.Linear(4 * D, D, bias=False)
        s.n1, s.n2 = nn.RMSNorm(D), nn.RMSNorm(D)

    def forward(s, x, mask):
        q, k, v = s.qkv(s.n1(x)).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4)
        x = x + s.o(flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(B, S, D))
        return x + s.down(F.silu(s.up(s.n2(x))))


emb = nn.Embedding(V, D).cuda()
blocks = nn.ModuleList(Block() for _ in range(L)).cuda()
head = nn.Linear(D, V).cuda()
for b in blocks:
    b.compile(backend="inductor", fullgraph=True)
mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S)
params = [*emb.parameters(), *blocks.parameters(), *head.parameters()]
opt = torch.optim.AdamW(params, lr=8e-4)
g = torch.Generator(device="cuda").manual_seed(0)
for step in range(1, 9):
    t0 = time.time()
    tok = torch.randint(0, V, (B, S + 1), device="cuda", generator=g)
    with torch.autocast("cuda", torch.bfloat16):
        x = emb(tok[:, :-1])
        for b in blocks:
            x = b(x, mask)
        loss = F.cross_entropy(head(x).float().view(-1, V), tok[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    print(f"step {step}: loss {loss.item():.4f} time {time.time() - t0:.2f} s", flush=True)
