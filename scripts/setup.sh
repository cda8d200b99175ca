#!/usr/bin/env bash
# Idempotent set-up for a fresh machine; a second run reuses what the first fetched.
#   - redis-server (Debian package), Java 17, Maven and Chromium (for the dashboard test) when missing
#   - promtool (Debian package prometheus) when missing, to check the /metrics endpoints
#   - iproute2 (`ip netns`, veth pairs) when missing, for the network-partition test
#   - the Kafka broker's jars from Maven Central, into a cache outside the repo
#     (skipped when KAFKA_HOME points at an unpacked Kafka distribution)
#   - a virtual environment in .venv with streamtrain and its test extras, and recbole's wheel
#     without its dependencies (it carries MovieLens-100K, the `movielens` source's data);
#     torch from a local wheel folder ($STREAMTRAIN_WHEELS, default ../shared/wheels) when it
#     holds one, else from the registry
#   - as root, for the compose stack offline (compose/offline.yml, tests/test_compose_stack.py):
#     Docker Engine and docker-compose (Debian's docker.io, docker-compose) and debootstrap; a Debian
#     bookworm rootfs with Python, Redis, Java 17 and Prometheus, cached as a tar (the images' base);
#     the wheels of streamtrain's dependencies in compose/wheels and the Kafka jars in
#     compose/offline/kafka-libs (the build contexts). Skipped with STREAMTRAIN_COMPOSE_STACK=0.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${STREAMTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/streamtrain}
kafka_version=$(sed -n 's/^KAFKA_VERSION = "\(.*\)"$/\1/p' "$root/streamtrain/launcher/kafka.py")
log() { printf '[setup] %s\n' "$*" >&2; }

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
if [ ! -x /usr/bin/chromium ]; then
  # tests/test_dashboard.py drives the coordinator's status page in headless Chromium.
  log "installing chromium"
  apt_install chromium
fi
if ! command -v promtool >/dev/null; then
  # promtool only (tests check every /metrics endpoint with `promtool check metrics`): a 23 MB download
  log "installing promtool (Debian package prometheus)"
  apt_install --no-install-recommends prometheus
  (command -v systemctl >/dev/null && systemctl disable --now prometheus >/dev/null 2>&1) || true
fi
if ! command -v ip >/dev/null; then
  # tests/test_partition.py gives a trainer its own network namespace and cuts its link
  log "installing iproute2"
  apt_install iproute2
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
venv="$root/.venv"
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { log "Python 3.11 or newer is needed (found $("$py" --version 2>&1))"; exit 1; }
  log "creating $venv"
  "$py" -m venv "$venv"
fi
wheels="${STREAMTRAIN_WHEELS:-$root/../shared/wheels}"
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
# --- the compose stack offline (compose/offline.yml) ------------------------------------------
# The first run takes minutes (debootstrap ~2 min, the wheels ~250 MB); later runs reuse the cache.
compose_base_packages=python3,python3-venv,ca-certificates,redis-server,openjdk-17-jre-headless,prometheus
debian_mirror() {
  # the host's Debian mirror (one-line or deb822 sources), not its security archive
  { grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | sed -E 's/\[[^]]*\] //' | awk '{print $2}'
    grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
  } | grep -v -- '-security' | head -n1
}
if [ "${STREAMTRAIN_COMPOSE_STACK:-1}" = 0 ]; then
  log "skipping the compose stack (STREAMTRAIN_COMPOSE_STACK=0)"
elif [ "$(id -u)" -ne 0 ]; then
  log "skipping the compose stack: dockerd and debootstrap need root"
else
  if [ ! -x /usr/sbin/dockerd ] || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing docker.io, docker-compose and debootstrap"
    apt_install docker.io docker-compose debootstrap
    # the package's system-wide engine is not used: the test starts its own (own data root and socket)
    (command -v systemctl >/dev/null && systemctl disable --now docker.service docker.socket >/dev/null 2>&1) || true
  fi
  base_tar="$cache/docker-base/bookworm-$(echo "$compose_base_packages" | sha256sum | cut -c1-12).tar"
  if [ ! -s "$base_tar" ]; then
    mirror=$(debian_mirror)
    mirror=${mirror:-http://deb.debian.org/debian}
    log "debootstrap bookworm ($compose_base_packages) from $mirror into $base_tar"
    rootfs="$cache/docker-base/rootfs.partial"
    mkdir -p "$cache/docker-base"
    # a debootstrap that failed part-way may leave the rootfs's /proc and /sys mounted
    for fs in proc sys; do umount "$rootfs/$fs" 2>/dev/null || true; done
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include="$compose_base_packages" bookworm "$rootfs" "$mirror" >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$base_tar.partial" .
    mv "$base_tar.partial" "$base_tar" && rm -rf "$rootfs"
  fi
  # wheels for Python 3.11 on Linux (the image's is bookworm's 3.11.2), torch from the local wheel
  # folder. pip evaluates dependency markers against the Python that downloads, not the target's:
  # what bookworm's 3.11.2 needs beyond a newer 3.11 is named here (redis: python_full_version < "3.11.3").
  compose_extra_wheels=("setuptools>=68" wheel "async-timeout>=4.0.3")
  wheel_cache="$cache/compose-wheels"
  torch_wheel=$(ls "$wheels"/torch-*.whl 2>/dev/null | head -n1 || true)
  want=$( (cat "$root/pyproject.toml"; echo "${torch_wheel##*/} ${compose_extra_wheels[*]}") | sha256sum | cut -c1-16)
  if [ "$(cat "$wheel_cache/.stamp" 2>/dev/null)" != "$want" ]; then
    log "downloading the compose image's wheels into $wheel_cache"
    rm -rf "$wheel_cache" && mkdir -p "$wheel_cache"
    "$venv/bin/python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
      "$root/pyproject.toml" > "$wheel_cache/requirements.txt"
    dl=("$venv/bin/python" -m pip download -q --disable-pip-version-check -d "$wheel_cache" --only-binary=:all:
        --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform linux_x86_64 --implementation cp)
    "${dl[@]}" ${torch_wheel:+"$torch_wheel"} -r "$wheel_cache/requirements.txt" "${compose_extra_wheels[@]}"
    "${dl[@]}" --no-deps "recbole==$recbole_version"
    echo "$want" > "$wheel_cache/.stamp"
  fi
  # the build contexts: hard links where the cache is on the same disk
  find "$root/compose/wheels" -name '*.whl' -delete
  cp -lf "$wheel_cache"/*.whl "$root/compose/wheels/" 2>/dev/null || cp -f "$wheel_cache"/*.whl "$root/compose/wheels/"
  kafka_libs=${KAFKA_HOME:+$KAFKA_HOME/libs}
  kafka_libs=${kafka_libs:-$cache/kafka-$kafka_version/libs}
  rm -rf "$root/compose/offline/kafka-libs" && mkdir -p "$root/compose/offline/kafka-libs"
  cp -lf "$kafka_libs"/*.jar "$root/compose/offline/kafka-libs/" 2>/dev/null \
    || cp -f "$kafka_libs"/*.jar "$root/compose/offline/kafka-libs/"
fi
log "ready"
