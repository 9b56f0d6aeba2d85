# Sourced from the repository root by tests/gpu/run.sh and bench/gangs.sh on a GPU machine:
# the appliance's dependencies from .whl/ when carried there (scripts/gpu-wheels.sh fetches them
# at the versions requirements.lock names, for the machine's Python),
# the tree on PYTHONPATH, what the machine has (GPUs, driver, torch), and the hook built.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nvshare-site .whl/*.whl
  export PYTHONPATH="/tmp/nvshare-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
make -s -j8 -C ld_hook build/libnvshare.so
