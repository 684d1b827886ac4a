#!/usr/bin/env bash
# Issue 69's targets on a quiet machine, one call (bench/trust_targets.py says what each part
# measures and judges): the carried wheels installed as for the device check
# (bench/carried_wheels.sh), then the parts within TRUST_BUDGET_S seconds (default 560: one call
# of a lent machine, 600 s at most; it does not fit beside the device check), the
# whole under `timeout` with its process group ended at the end, whatever is left of it.
#
#   bash bench/trust_targets.sh [bench/trust_targets.py's options: --tiny, --audit-pairs N, ...]
#
# Exit status: 0 when every part passed; the summary block is the output's last lines, and
# $OUT/trust_targets.txt where OUT is set.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${TRUST_WHEELS-.whl}
WHEELS_S=45
BUDGET_S=${TRUST_BUDGET_S:-560}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. bench/carried_wheels.sh  # the install: PY, WHEELS, WHEELS_S as set above
# The parts' budget is what the install left; a margin for ending the last part's group.
LEFT=$(( BUDGET_S - (SECONDS) - 10 ))
# Not a group leader (a script has no job control), so setsid execs: its pid is the session.
setsid timeout -k 10 $(( LEFT + 5 )) "$PY" bench/trust_targets.py --budget-s "$LEFT" "$@" &
LEADER=$!
wait "$LEADER"
CODE=$?
# Its session (the parts are process groups inside it): anything a part left behind.
pkill -KILL -s "$LEADER" 2>/dev/null || kill -KILL -- -"$LEADER" 2>/dev/null
exit "$CODE"
