#!/usr/bin/env bash
# Where the host's time goes in the service's GPU loops against the bare ones: py-spy (carried as a
# wheel in .whl/, see /work/.library/device/README.md) samples one long block of each loop
# (bench.gpu_profile --loop), idle time included, as collapsed stacks in $OUT; then bench.gpu's
# lm ratios alone. Needs CUDA.
#
#     bash bench/gpu_spy.sh
set -u
out=${OUT:-bench/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl && export PATH=/tmp/pyspy/bin:$PATH
for loop in ${LOOPS:-cnn-service cnn-bare lm-service lm-bare}; do
    timeout 120 py-spy record --idle --rate 50 --nonblocking --format raw -o "$out/$loop.txt" -- \
        python3 -m bench.gpu_profile --loop "$loop" || echo "$loop: exit $?"
done
timeout 200 python3 -c "import json; from bench.gpu import lm_step_ratios; print(json.dumps(lm_step_ratios()))" \
    > "$out/lm.json" || echo "lm ratios: exit $?"
python3 -c "import json; d = json.load(open('$out/lm.json')); print({p: (r['lm_step_ratio'], r['pair_ratios']) for p, r in d.items()})"
