# Sourced by scripts/setup.sh and scripts/setup_tests.sh: the paths and helpers both use.
# Expects $log_tag (the prefix of log lines) to be set by the sourcing script.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${STREAMTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/streamtrain}
kafka_version=$(sed -n 's/^KAFKA_VERSION = "\(.*\)"$/\1/p' "$root/streamtrain/launcher/kafka.py")
venv="$root/.venv"
wheels="${STREAMTRAIN_WHEELS:-$root/../shared/wheels}"
log() { printf '[%s] %s\n' "$log_tag" "$*" >&2; }

apt_updated=0
apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if [ "$apt_updated" -eq 0 ]; then
    $sudo apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
