#!/usr/bin/env bash
# Issue 29, round 12 (1,500 steps, four runs at once, niced). Round 11: shorter outer
# cool-downs are worse (10%: +0.030/+0.040, 15%: +0.027/+0.032, against 30%: +0.016/
# +0.017 and 50%: +0.017/+0.020 on seeds 1, 2): the outer Nesterov step at lr 0.7,
# momentum 0.9 (about 7x the mean pseudo-gradient once its momentum builds) hurts late
# in the run. A gentler outer step all along, with the 30% cool-down: lr 0.5 (5x), and
# momentum 0.8 (3.5x), on the hard seeds 1, 2.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--recipe slow-link --no-progress"
for run in "olr05_seed1 --outer-lr 0.5 --seed 1" \
           "olr05_seed2 --outer-lr 0.5 --seed 2" \
           "om08_seed1 --outer-momentum 0.8 --seed 1" \
           "om08_seed2 --outer-momentum 0.8 --seed 2"; do
  set -- $run
  name=r12_$1; shift 1
  nice -n 10 python examples/lm.py $common "$@" --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
