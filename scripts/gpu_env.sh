# Sourced by the scripts a lent CUDA machine runs (gpu_check.sh): the packages it lacks, from
# the wheels in .whl/ (pip download, see the device notes), then PYTHONPATH and the machine's line.
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
date +%T
