#!/usr/bin/env bash
# Deterministic per-operation cost of every variant of benches/op_cost.rs: instructions
# (callgrind Ir) and allocations, each over its baseline.
#
#   scripts/op_cost.sh                      # every variant (a few minutes)
#   scripts/op_cost.sh client_fresh ...     # some variants (their baselines are added)
#
# Environment: OP_COST_N1 / OP_COST_N2 (op counts of the two callgrind runs, default 2000 and
# 4000), OP_COST_ALLOC_N (ops of the native allocation run, default 10000), OP_COST_OUT
# (where the callgrind files and logs go, default <target>/op_cost), CARGO_TARGET_DIR.
#
# How it measures:
# - Ir/op = (Ir(N2) - Ir(N1)) / (N2 - N1) over two callgrind runs of the same variant, which
#   cancels its setup (building the stack, filling the store, warming up). On x86-64 the
#   runs use --instr-atstart=no and the binary switches instrumentation on around its
#   measured loop only, so the setup runs at valgrind's lowest slowdown.
# - SHA Ir/op: valgrind hides SHA-NI, so sha2 runs its software compression under callgrind
#   (natively it uses the SHA-NI instructions, several times cheaper). The script sums the
#   inclusive cost of sha2's block-compression entry points (sha2::sha256::compress256,
#   sha2::sha512::compress512) from `callgrind_annotate --inclusive=yes` of each run, per op
#   by the same difference; "non-SHA" columns are Ir/op minus that.
# - allocs/op: a native run (no valgrind) of each variant with a counting global allocator,
#   counted around the measured loop and divided by its op count.
set -euo pipefail

die() {
    echo "op_cost.sh: ERROR: $*" >&2
    exit 1
}

command -v valgrind >/dev/null 2>&1 ||
    die "valgrind is not installed (or not on PATH): it is required (apt-get install valgrind)"
command -v callgrind_annotate >/dev/null 2>&1 ||
    die "callgrind_annotate is not installed (it comes with valgrind)"
command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH"
valgrind --tool=callgrind --version >/dev/null 2>&1 || die "valgrind does not run"

N1=${OP_COST_N1:-2000}
N2=${OP_COST_N2:-4000}
ALLOC_N=${OP_COST_ALLOC_N:-10000}
[[ $N1 =~ ^[0-9]+$ && $N2 =~ ^[0-9]+$ && $ALLOC_N =~ ^[1-9][0-9]*$ ]] ||
    die "OP_COST_N1, OP_COST_N2 and OP_COST_ALLOC_N must be whole numbers"
((N2 > N1)) || die "OP_COST_N2 ($N2) must be larger than OP_COST_N1 ($N1)"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$SECONDS

# --- Build once -------------------------------------------------------------------------
echo "op_cost.sh: building benches/op_cost (release)..." >&2
bin=$(cargo bench --no-run --bench op_cost --message-format=json-render-diagnostics |
    sed -n 's/.*"executable":"\([^"]*\/op_cost-[0-9a-f]*\)".*/\1/p' | tail -n 1)
[[ -n $bin && -x $bin ]] || die "could not find the built op_cost binary"
outdir=${OP_COST_OUT:-$(dirname "$bin")/../op_cost}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)

case $(uname -m) in
x86_64) instr=(--instr-atstart=no) ;; # the binary starts instrumentation at its loop
*) instr=(--instr-atstart=yes) ;;     # no client requests: count all, the difference cancels
esac

# --- Which variants, and their baselines ----------------------------------------------------
baseline_of() {
    case $1 in
    bare_op_waiting) echo - ;;
    *_waiting) echo bare_op_waiting ;;
    stack_read) echo bare ;;
    client_* | stack_*) echo bare_op ;;
    tool_bare) echo - ;;
    tool_*) echo tool_bare ;;
    frozen_retry* | tower_retry_clone*) echo bare ;;
    server_bare | server_bare_digest) echo - ;;
    server_*_digest) echo server_bare_digest ;;
    server_*) echo server_bare ;;
    *) echo - ;;
    esac
}

mapfile -t all < <("$bin" list)
if (($# > 0)); then
    wanted=("$@")
    for v in "$@"; do
        b=$(baseline_of "$v")
        [[ $b != - ]] && wanted+=("$b")
    done
else
    wanted=("${all[@]}")
fi
variants=()
for v in "${all[@]}"; do # the binary's order, each once
    for w in "${wanted[@]}"; do
        if [[ $v == "$w" ]]; then
            variants+=("$v")
            break
        fi
    done
done
for w in "${wanted[@]}"; do
    printf '%s\n' "${all[@]}" | grep -qx -- "$w" || die "unknown variant '$w' (op_cost list)"
done

# --- Callgrind ------------------------------------------------------------------------------
total_ir() { # the run's Ir: its totals: line (summary: when there is none)
    awk '/^totals:/ { t = $2 } /^summary:/ { s = $2 } END { print (t != "" ? t : s) }' "$1"
}

sha_ir() { # inclusive Ir of sha2's compression entry points
    callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null | awk '
        /sha2::sha(256|512)::compress(256|512) \[/ { gsub(",", "", $1); entry += $1 }
        /sha2::sha(256|512)::(soft|x86_sha)/         { gsub(",", "", $1); leaf += $1 }
        END {
            if (entry == 0 && leaf > 0) { print "LEAF_ONLY"; exit }
            print entry + 0
        }'
}

declare -A IR SHA ALLOCS
for v in "${variants[@]}"; do
    echo "op_cost.sh: callgrind $v ($N1 and $N2 ops)..." >&2
    irs=()
    shas=()
    for n in "$N1" "$N2"; do
        out="$outdir/$v.$n.callgrind"
        log="$outdir/$v.$n.log"
        if ! valgrind --tool=callgrind "${instr[@]}" --callgrind-out-file="$out" \
            "$bin" "$v" "$n" >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            die "$v ($n ops) failed under callgrind; full log: $log"
        fi
        ir=$(total_ir "$out")
        [[ $ir =~ ^[0-9]+$ ]] || die "no instruction count in $out"
        sha=$(sha_ir "$out")
        [[ $sha != LEAF_ONLY ]] ||
            die "$out: sha2's compression ran but its entry point was not found (inlined?)"
        irs+=("$ir")
        shas+=("$sha")
    done
    ((irs[1] > irs[0])) ||
        die "$v: Ir did not grow with the op count (${irs[0]} at $N1, ${irs[1]} at $N2): was instrumentation switched on?"
    IR[$v]=$(awk -v a="${irs[0]}" -v b="${irs[1]}" -v n1="$N1" -v n2="$N2" \
        'BEGIN { printf "%.1f", (b - a) / (n2 - n1) }')
    SHA[$v]=$(awk -v a="${shas[0]}" -v b="${shas[1]}" -v n1="$N1" -v n2="$N2" \
        'BEGIN { printf "%.1f", (b - a) / (n2 - n1) }')
done

# --- Allocations, natively -----------------------------------------------------------------
echo "op_cost.sh: allocations, natively ($ALLOC_N ops each)..." >&2
"$bin" allocs "$ALLOC_N" "${variants[@]}" >"$outdir/allocs.txt" ||
    die "the native allocation run failed"
while read -r line; do
    v=$(sed -n 's/.*variant=\([^ ]*\).*/\1/p' <<<"$line")
    a=$(sed -n 's/.*allocs_per_op=\([^ ]*\).*/\1/p' <<<"$line")
    [[ -n $v && -n $a ]] && ALLOCS[$v]=$a
done <"$outdir/allocs.txt"
for v in "${variants[@]}"; do
    [[ -n ${ALLOCS[$v]:-} ]] || die "no allocation count for $v in $outdir/allocs.txt"
done

# --- The table -------------------------------------------------------------------------------
fmt='%-26s %-12s %10s %10s %10s %12s %13s %10s %11s\n'
printf "$fmt" variant baseline Ir/op +Ir/op SHA_Ir/op non-SHA_Ir/op +non-SHA_Ir allocs/op +allocs/op
printf "$fmt" -------------------------- ------------ ---------- ---------- ---------- \
    ------------ ------------- ---------- -----------
for v in "${variants[@]}"; do
    b=$(baseline_of "$v")
    ir=${IR[$v]} sha=${SHA[$v]} al=${ALLOCS[$v]}
    nonsha=$(awk -v i="$ir" -v s="$sha" 'BEGIN { printf "%.0f", i - s }')
    if [[ $b != - ]]; then
        plus_ir=$(awk -v i="$ir" -v j="${IR[$b]}" 'BEGIN { printf "%+.0f", i - j }')
        plus_nonsha=$(awk -v i="$ir" -v s="$sha" -v j="${IR[$b]}" -v t="${SHA[$b]}" \
            'BEGIN { printf "%+.0f", (i - s) - (j - t) }')
        plus_al=$(awk -v a="$al" -v c="${ALLOCS[$b]}" 'BEGIN { printf "%+.2f", a - c }')
    else
        plus_ir=- plus_nonsha=- plus_al=-
    fi
    printf "$fmt" "$v" "$b" "$(printf '%.0f' "$ir")" "$plus_ir" "$(printf '%.0f' "$sha")" \
        "$nonsha" "$plus_nonsha" "$(printf '%.2f' "$al")" "$plus_al"
done
echo
echo "Ir/op: callgrind instructions per operation, (Ir($N2) - Ir($N1)) / $((N2 - N1)); SHA_Ir/op:"
echo "those inside sha2's compression (software under valgrind, SHA-NI natively); '+' columns:"
echo "over the baseline variant; allocs/op: native run, $ALLOC_N ops. Files: $outdir"
echo "op_cost.sh: done in $((SECONDS - started)) s" >&2
