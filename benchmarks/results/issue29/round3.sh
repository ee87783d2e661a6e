#!/usr/bin/env bash
# Issue 29, round 3 (1,500 steps, seed 0, four runs at once, niced): 4-bit warm-up and
# 4-bit DiLoCo averages at H=32, the switch at 100/200/300, the outer decay on or off.
# DDP's run at these settings (commit 35fac61): val loss 1.2104, 2,873.9 MB per device.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --seed 0 --bits 4 --warmup-bits 4"
for run in "s100 --start 100 --outer-decay" "s200 --start 200 --outer-decay" "s200_nodecay --start 200" "s300 --start 300 --outer-decay"; do
  set -- $run
  name=r3_d32_q4w4_$1; shift
  nice -n 10 python examples/lm.py --compare diloco32 "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
