#!/usr/bin/env bash
# Idempotent set-up for a fresh machine; a second run reuses what the first fetched.
#   - redis-server (Debian package), Java 17 and Maven when missing
#   - the Kafka broker's jars from Maven Central, into a cache outside the repo
#     (skipped when KAFKA_HOME points at an unpacked Kafka distribution)
#   - a virtual environment in .venv with streamtrain and its test extras, and recbole's wheel
#     without its dependencies (it carries MovieLens-100K, the `movielens` source's data);
#     torch from a local wheel folder ($STREAMTRAIN_WHEELS, default ../shared/wheels) when it
#     holds one, else from the registry
# Only what `streamtrain up` uses (ruff, mypy and pytest come with the virtual environment); what only
# the tests use is scripts/setup_tests.sh's, which scripts/test.sh runs after this one.
set -euo pipefail

log_tag=setup
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# --- system packages -----------------------------------------------------------
if ! command -v redis-server >/dev/null; then
  log "installing redis-server"
  apt_install redis-server
  # Debian's package starts a system-wide server; we only ever use our own.
  (command -v systemctl >/dev/null && systemctl disable --now redis-server >/dev/null 2>&1) || true
fi
if [ -z "${KAFKA_HOME:-}" ]; then
  command -v java >/dev/null || { log "installing Java 17"; apt_install openjdk-17-jre-headless; }
fi
# --- Kafka jars ---------------------------------------------------------------
if [ -n "${KAFKA_HOME:-}" ]; then
  ls "$KAFKA_HOME"/libs/kafka_2.13-*.jar >/dev/null 2>&1 \
    || { log "KAFKA_HOME=$KAFKA_HOME has no libs/kafka_2.13-*.jar"; exit 1; }
  log "using Kafka from KAFKA_HOME=$KAFKA_HOME"
else
  libs="$cache/kafka-$kafka_version/libs"
  if ! ls "$libs"/kafka_2.13-"$kafka_version".jar >/dev/null 2>&1; then
    command -v mvn >/dev/null || { log "installing Maven"; apt_install maven; }
    log "fetching Kafka $kafka_version jars into $libs"
    tmp="$libs.partial"
    rm -rf "$tmp"
    mvn -q -B -Dstyle.color=never -f "$root/scripts/kafka/pom.xml" -Dkafka.version="$kafka_version" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp"
    rm -rf "$libs" && mv "$tmp" "$libs"
  fi
fi

# --- Python environment ---------------------------------------------------------
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { log "Python 3.11 or newer is needed (found $("$py" --version 2>&1))"; exit 1; }
  log "creating $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.streamtrain-deps"
want=$( (cat "$root/pyproject.toml"; ls "$wheels" 2>/dev/null || true) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  torch_wheel=$(ls "$wheels"/torch-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$torch_wheel" ]; then
    log "installing torch from $torch_wheel"
    "${pip[@]}" "$torch_wheel"
  fi
  log "installing streamtrain and its dependencies"
  "${pip[@]}" -e "$root[test]"
  echo "$want" > "$stamp"
fi
# MovieLens-100K (the `movielens` source, `up --example movielens`) ships inside the recbole wheel;
# --no-deps: only its data files are read (datastream/movielens.py), none of its modules or heavy
# dependencies. Not in pyproject.toml, whose dependencies would pull recbole's in.
recbole_version=1.2.1
if [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("recbole"))' 2>/dev/null)" \
     != "$recbole_version" ]; then
  log "installing recbole $recbole_version (MovieLens-100K), without its dependencies"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "recbole==$recbole_version"
fi
log "ready"
