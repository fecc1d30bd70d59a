#!/usr/bin/env bash
# Lines of Python in lingua_zeco/ + apps/ at a commit (or the working tree), and the net change of each
# commit of issue 21 ("one of each"); run from the repository root.
set -eu
count() {  # $1: commit, or "tree" for the working tree
    if [ "$1" = tree ]; then find lingua_zeco apps -name '*.py' -print0 | xargs -0 cat | wc -l; return; fi
    git ls-tree -r --name-only "$1" -- lingua_zeco apps | grep '\.py$' | while read -r f; do git show "$1:$f"; done | wc -l
}
net() { git show --numstat --format= "$1" -- lingua_zeco apps | awk '$3 ~ /\.py$/ {n += $1 - $2} END {print n + 0}'; }
echo "## lines of lingua_zeco/ + apps/ (*.py)"
for c in "$@"; do printf '%-10s %6s  %s\n' "$c" "$(count "$c")" "$( [ "$c" = tree ] && echo 'working tree' || git log -1 --format='%ad %s' --date=format:'%m-%d %H:%M' "$c" | cut -c1-90)"; done
echo
echo "## net change (*.py lines of lingua_zeco/ + apps/) of each commit of issue 21"
total=0
for c in 2a0007d 7fd58ad 215aa6f b279e27 a86d4ea bd79c6f e05bab9 c690c58 12e03f1 4fed1bb 6cadbf5 d160254 c8af0c0 \
         fa01f73 676de84 6da6586; do
    n=$(net "$c"); total=$((total + n))
    printf '%6d  %s\n' "$n" "$(git log -1 --format='%h %ad %s' --date=format:'%m-%d' "$c" | cut -c1-100)"
done
echo "total $total (of which +161: lingua_zeco/perf_model/inputs.py, new in bd79c6f for item 5)"
