#!/usr/bin/env bash
# The text the float8 loss-parity runs train on when they are to measure more than memorisation
# (PARITY_DATA=OUT bash setup/gpu/run.sh parity_bf16, then parity_float8): the reStructuredText sources of the
# Python 3.11 and the Linux 6.1 documentation from Debian bookworm's python3.11-doc and linux-doc-6.1 packages,
# about 35 MB of English prose in 3,681 documents (the built-in corpus is 0.43 MB): 1000 steps of 16K byte tokens
# read less than half of it, so no document comes twice. setup/prepare_data.py shuffles them into OUT/train and
# OUT/valid with its default seed.
# Run it where Debian's mirror is reachable (the GPU machine has no network) and carry OUT to the GPU machine:
#     bash setup/gpu/parity_corpus.sh dumps/parity_corpus
# The package versions are pinned (the corpus is the same wherever it is built); apt-get names a version the
# mirror no longer has. Exit code 2 for bad arguments, else the first failing command's.
set -eu
[ $# -eq 1 ] || { echo "error: give the output folder, e.g. bash setup/gpu/parity_corpus.sh dumps/parity_corpus"; exit 2; }
OUT_DIR=$1
[ ! -e "$OUT_DIR" ] || { echo "error: $OUT_DIR exists; remove it or name another folder"; exit 2; }
PACKAGES=(python3.11-doc=3.11.2-6+deb12u8 linux-doc-6.1=6.1.176-1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q "${PACKAGES[@]}")
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
python3 "$(dirname "$0")/../prepare_data.py" out="$OUT_DIR" \
    input="$work/root/usr/share/doc/python3.11/html/_sources,$work/root/usr/share/doc/linux-doc-6.1/html/_sources"
