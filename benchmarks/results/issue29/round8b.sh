#!/usr/bin/env bash
# Issue 29, round 8b (beside round 8): the previous recipe (commit 188dab6: DiLoCo H=32 from
# step 500, float32 averages and warm-up, the outer learning rate's cosine to 0) on seed
# 1, with its history, for docs/lm.md's plot of loss against bytes beside DDP's seed 1
# (round 7) and the slow-link recipe's seed 1 (round 7). Commit 188dab6 measured 1.2127.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
nice -n 10 python examples/lm.py --compare diloco32 --start 500 --outer-decay --seed 1 \
  --steps 1500 --warmup 50 --eval-every 100 --no-progress \
  --json $out/r8_previous_d32_s500_seed1.json > $out/r8_previous_d32_s500_seed1.log 2>&1
