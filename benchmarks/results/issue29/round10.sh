#!/usr/bin/env bash
# Issue 29, round 10 (1,500 steps, four runs at once, niced): round 9 found that more
# frequent averages over the last 300 steps make the end worse (+0.024/+0.031 at every 12
# steps). The quadratic synchronization rule (Gu et al., ICLR 2024) goes the other way:
# the period grows as the inner learning rate decays, max(24, QSR / (lr/peak)**2), and
# the run's last step averages. QSR 0.5: the last regular average near step 1165, then
# only the last step's (44 averages); QSR 1.5: near 1084 (40 averages). The recipe
# otherwise (8-bit averages, 4-bit warm-up to 150, cool-down 30%); the hard seeds 1, 2.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--recipe slow-link --no-progress"
for run in "qsr05_seed1 --qsr 0.5 --seed 1" \
           "qsr05_seed2 --qsr 0.5 --seed 2" \
           "qsr15_seed1 --qsr 1.5 --seed 1" \
           "qsr15_seed2 --qsr 1.5 --seed 2"; do
  set -- $run
  name=r10_$1; shift 1
  nice -n 10 python examples/lm.py $common "$@" --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
