#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (bench/gpu/wheels.txt) into .whl/ at the repository's
# root, for CPython 3.12 on manylinux x86_64, then print what a GPU run would send (the
# repository and the wheels, against the 64 MiB a run may carry). Run it on a machine that
# reaches PyPI, before the GPU machine is at hand; .whl/ is ignored by git (.gitignore).
#
#   bash bench/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
rm -rf .whl   # one version of each: two wheels of one package stop the install
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
grep -v '^\s*#' bench/gpu/wheels.txt | grep -v '^\s*$' | while read -r requirement; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$requirement"
done
ls -l .whl
"$python" bench/gpu/run.py --dry-run --quiet
