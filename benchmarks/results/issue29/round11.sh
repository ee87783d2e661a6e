#!/usr/bin/env bash
# Issue 29, round 11 (1,500 steps, four runs at once, niced). Round 10: a period that
# grows as the learning rate decays (QSR) is worse at the end (+0.025/+0.027 at QSR 0.5,
# +0.032/+0.035 at 1.5: level with DDP at step 1200, then no averages and little
# progress), as were more frequent averages (round 9). The outer step's cool-down is the
# lever that moved the end most (round 6), and 30% beat 50% on all three seeds: shorter
# cool-downs, 15% and 10% of the outer steps, on the hard seeds 1, 2.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--recipe slow-link --no-progress"
for run in "cool015_seed1 --outer-cooldown 0.15 --seed 1" \
           "cool015_seed2 --outer-cooldown 0.15 --seed 2" \
           "cool010_seed1 --outer-cooldown 0.1 --seed 1" \
           "cool010_seed2 --outer-cooldown 0.1 --seed 2"; do
  set -- $run
  name=r11_$1; shift 1
  nice -n 10 python examples/lm.py $common "$@" --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
