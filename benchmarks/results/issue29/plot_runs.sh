#!/usr/bin/env bash
# Issue 29 (2026-12-04): seed 1 of DDP, the first slow-link recipe (commit 846cbf8) and
# the recipe again, with examples/lm.py recording the bytes on the node links per
# evaluation, for docs/lm_bytes.png (three runs at once, niced). Each is a rerun of a
# recorded run (r7_ddp_seed1, r7_cool03_d24_s150_seed1, r13_om08_d32_s100_seed1): its
# loss should match to the digit.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --seed 1"
nice -n 10 python examples/lm.py --compare ddp $common --json $out/p_ddp_seed1.json > $out/p_ddp_seed1.log 2>&1 &
nice -n 10 python examples/lm.py --recipe slow-link --compare diloco24 --start 150 --outer-momentum 0.9 $common --json $out/p_s12_recipe_seed1.json > $out/p_s12_recipe_seed1.log 2>&1 &
nice -n 10 python examples/lm.py --recipe slow-link $common --json $out/p_recipe_seed1.json > $out/p_recipe_seed1.log 2>&1 &
wait
python benchmarks/lm_bytes_plot.py --out docs/lm_bytes.png "DDP=$out/p_ddp_seed1.json" \
  "first slow-link recipe (H=24 from 150, momentum 0.9)=$out/p_s12_recipe_seed1.json" \
  "slow-link recipe (H=32 from 100, momentum 0.8)=$out/p_recipe_seed1.json"
