#!/usr/bin/env bash
# Run the tests that kill processes or wait on other processes N times, each time in a fresh
# pytest process, and print how often each test passed. Not run by CI: it takes N times as long
# as those tests (about a minute per round on a 2-core machine). A test that fails once in N is
# flaky; every test here must pass N of N.
#
#   scripts/flake_check.sh [N] [pytest paths or node ids...]     (default: 30, the list below)
#   PYTHON=/path/to/python scripts/flake_check.sh 30 tests/faults
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-30}
shift || true
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(
        tests/faults                                   # kill -9 at exact points and at instants
        tests/data/test_prepare.py::test_killed_preparation_is_never_used
        tests/trainer/test_train_cli.py::test_sigterm_saves_a_checkpoint_that_resumes
        tests/trainer/test_loop.py::test_wandb_offline_run_holds_config_and_metrics
        tests/parallel/test_torchrun.py                # a dead rank, collective timeouts
    )
fi
python=${PYTHON:-python}
export WANDB_MODE=offline WANDB_SILENT=true HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT

for i in $(seq 1 "$n"); do
    start=$SECONDS
    # Its own --basetemp: no round (nor another pytest on the machine) shares temporary files.
    if "$python" -m pytest -q -p no:cacheprovider --basetemp="$reports/tmp" \
        --junitxml="$reports/$i.xml" "${tests[@]}" >"$reports/$i.log" 2>&1; then
        echo "round $i/$n: passed ($((SECONDS - start)) s)"
    else
        echo "round $i/$n: FAILED ($((SECONDS - start)) s); its output:"
        grep -E "^(FAILED|ERROR)|Error" "$reports/$i.log" | head -20 | sed 's/^/    /'
    fi
    rm -rf "$reports/tmp"
done

# One line per test: passed/rounds, from the JUnit reports.
"$python" - "$reports" "$n" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

reports, n = Path(sys.argv[1]), int(sys.argv[2])
ran, passed = Counter(), Counter()
for report in reports.glob("*.xml"):
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        ran[name] += 1
        passed[name] += not any(c.tag in ("failure", "error", "skipped") for c in case)
width = max(map(len, ran), default=0)
print(f"\n{'test':<{width}}  passed")
for name in sorted(ran):
    print(f"{name:<{width}}  {passed[name]}/{n}" + ("" if passed[name] == n else "  <- FLAKY"))
print(f"\n{sum(n - passed[name] for name in ran)} failures in {n} rounds of {len(ran)} tests")
EOF
