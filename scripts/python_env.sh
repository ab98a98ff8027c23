# Sourced by install.sh, test.sh, demo.sh: PY = the interpreter the package is installed in.
#   $PYTHON, where set;
#   else the active virtual environment or conda environment ($VIRTUAL_ENV, $CONDA_PREFIX);
#   else .venv in the repository, created with `python3 -m venv` where it does not exist yet
#   (a system Python may be marked externally managed: pip refuses to install into it).
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY=$VIRTUAL_ENV/bin/python
elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
  PY=$CONDA_PREFIX/bin/python
else
  if [ ! -x .venv/bin/python ]; then
    echo "creating the virtual environment .venv (python3 -m venv)" >&2
    python3 -m venv .venv || {
      echo "could not create .venv: install the venv module (Debian/Ubuntu: apt install python3-venv)" \
           "or activate an environment of your own, then run this again" >&2
      exit 1
    }
  fi
  PY=$PWD/.venv/bin/python
fi
