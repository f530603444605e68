#!/usr/bin/env bash
# Build the wheel and use it outside the checkout: a fresh venv in a temporary folder, then, from that
# folder, `moeviz --version`, `moeviz report` on the default sample, `moeviz app` answering on a port, and
# the installed app script opening the default sample (Streamlit AppTest). Takes minutes: the venv gets
# the pinned CPU torch and every dependency. Usage: scripts/check_wheel.sh  (PORT=8599, TORCH=torch==2.13.0)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
PORT=${PORT:-8599}
TORCH=${TORCH:-torch==2.13.0}
WORK=$(mktemp -d /tmp/moeviz-wheel.XXXXXX)
APP_PID=
cleanup() {
  if [ -n "$APP_PID" ]; then kill "$APP_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "== build the wheel from a clean copy of the tree (no stale build/)"
"$PY" - "$REPO" "$WORK/src" <<'EOF'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], ignore=shutil.ignore_patterns(
    ".git", ".venv", ".venv-vllm", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "docs", "benchmarks"))
EOF
"$PY" -m pip wheel --no-deps -q -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/moeviz-*.whl)
echo "$WHEEL ($(du -h "$WHEEL" | cut -f1))"

echo "== a fresh venv with the wheel"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$TORCH" "$WHEEL"

cd "$WORK"  # outside the checkout from here on
export HF_HUB_OFFLINE=1
BIN="$WORK/venv/bin"
"$BIN/moeviz" --version

echo "== moeviz report on the default sample"
"$BIN/moeviz" report --model sample:mixtral-healthy --text hi

echo "== moeviz app on port $PORT"
"$BIN/moeviz" app --server.headless true --server.port "$PORT" --browser.gatherUsageStats false \
  >"$WORK/app.log" 2>&1 &
APP_PID=$!
for _ in $(seq 120); do
  if [ "$(curl -s "http://127.0.0.1:$PORT/_stcore/health" || true)" = ok ]; then break; fi
  sleep 1
done
curl -sf -o /dev/null "http://127.0.0.1:$PORT/" || { cat "$WORK/app.log"; exit 1; }
echo "app answers on http://127.0.0.1:$PORT/"
kill "$APP_PID"
APP_PID=

echo "== the installed app script opens the default sample"
"$BIN/python" - <<'EOF'
import sys

from streamlit.testing.v1 import AppTest

from moeviz.resources import bundled_path

app = bundled_path("app")
assert "site-packages" in str(app), f"not the installed app: {app}"
sys.path.insert(0, str(app))  # as `streamlit run` does
at = AppTest.from_file(str(app / "streamlit_app.py"), default_timeout=300).run()
assert not at.exception, [e.value for e in at.exception]
assert not at.error, [e.value for e in at.error]
shown = " ".join(str(getattr(e, "value", "")) for e in [*at.main, *at.sidebar])
assert "mixtral-healthy" in shown and "MoE layers" in shown, shown[:2000]
print(f"{app}/streamlit_app.py: default sample open, no error")
EOF
echo "== wheel OK"
