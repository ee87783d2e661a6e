#!/usr/bin/env bash
# Issue 29, round 1 (exploration: 600 steps, seed 0, four runs at once, niced).
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 600 --warmup 50 --eval-every 50 --no-progress --seed 0"
nice -n 10 python examples/lm.py --compare ddp $common --json $out/r1_ddp.json > $out/r1_ddp.log 2>&1 &
nice -n 10 python examples/lm.py --compare diloco32 --start 100 --bits 4 --warmup-bits 4 --outer-decay $common --json $out/r1_d32_s100_q4_w4.json > $out/r1_d32_s100_q4_w4.log 2>&1 &
nice -n 10 python examples/lm.py --compare diloco32 --start 50 --bits 4 --warmup-bits 4 --outer-decay $common --json $out/r1_d32_s50_q4_w4.json > $out/r1_d32_s50_q4_w4.log 2>&1 &
nice -n 10 python examples/lm.py --compare diloco32 --start 100 --bits 8 --warmup-bits 8 --outer-decay $common --json $out/r1_d32_s100_q8_w8.json > $out/r1_d32_s100_q8_w8.log 2>&1 &
wait
