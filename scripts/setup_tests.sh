#!/usr/bin/env bash
# What only the tests and benches use, after scripts/setup.sh (scripts/test.sh runs both; the main job needs
# none of it): wrk (bench/serving.py's load generator), and
#   - Chromium (the dashboard's browser test), promtool (Debian package prometheus: every /metrics
#     endpoint is checked with it) and iproute2 (`ip netns`, veth pairs: the network-partition test)
# and, as root only, the compose stack's offline build (compose/offline.yml, tests/test_compose_stack.py):
#   - Docker Engine and docker-compose (Debian's docker.io, docker-compose) and debootstrap
#   - a Debian bookworm rootfs with Python, Redis, Java 17 and Prometheus, cached as a tar (the images' base)
#   - the wheels of streamtrain's dependencies in compose/wheels and the Kafka jars in
#     compose/offline/kafka-libs (the build contexts)
# Skipped with STREAMTRAIN_COMPOSE_STACK=0 (which also skips the test).
set -euo pipefail

log_tag=setup-tests
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recbole_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("recbole"))')

if [ ! -x /usr/bin/chromium ]; then
  # tests/test_coordinator_dashboard.py drives the coordinator's status page in headless Chromium.
  log "installing chromium"
  apt_install chromium
fi
if ! command -v promtool >/dev/null; then
  # promtool only (tests check every /metrics endpoint with `promtool check metrics`): a 23 MB download
  log "installing promtool (Debian package prometheus)"
  apt_install --no-install-recommends prometheus
  (command -v systemctl >/dev/null && systemctl disable --now prometheus >/dev/null 2>&1) || true
fi
if ! command -v wrk >/dev/null; then
  # the load generator of bench/serving.py (an HTTP benchmark tool that is not ours), 50 kB
  log "installing wrk"
  apt_install wrk
fi
if ! command -v ip >/dev/null; then
  # tests/test_streamtrain_partition.py gives a trainer its own network namespace and cuts its link
  log "installing iproute2"
  apt_install iproute2
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
