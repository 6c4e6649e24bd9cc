# Sourced by the scripts that compile pyklei's C code: PK_CFLAGS, the flags of
# pyklei_ext/cflags.txt (the one place for them; setup.py reads the same file) as an array.
# Usage: source "$(dirname "$0")/cflags.sh"; gcc -O3 "${PK_CFLAGS[@]}" ...
PK_CFLAGS=()
while read -r -a _pk_words; do
    [ ${#_pk_words[@]} -eq 0 ] && continue
    case "${_pk_words[0]}" in \#*) continue ;; esac
    PK_CFLAGS+=("${_pk_words[@]}")
done <"$(dirname "${BASH_SOURCE[0]}")/../pyklei_ext/cflags.txt"
unset _pk_words

# pk_compile_objects CC DIR SRC... -- FLAGS...: compiles each SRC with FLAGS into DIR/SRC.o, as
# many at once as there are cores, the largest sources first (the attention file alone takes
# minutes under the sanitizers: started first, it ends with the rest). ccache goes in front of
# CC when it is installed: CI keeps its cache, so a file that did not change costs nothing, in
# whichever folder the checkout is (the objects' debug info keeps the folder of the first
# build). PK_OBJS: the objects, in SRC order. Returns non-zero, once every compile has ended,
# if any failed (the compiler has said why).
pk_compile_objects() {
    local cc=$1 dir=$2 s launcher=() srcs=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do srcs+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    command -v ccache >/dev/null && launcher=(ccache)
    PK_OBJS=()
    for s in "${srcs[@]}"; do
        mkdir -p "$dir/$(dirname "$s")"
        PK_OBJS+=("$dir/$s.o")
    done
    # xargs: one compile per line, -P at once, and it waits for all of them before it exits
    # shellcheck disable=SC2012
    ls -S "${srcs[@]}" | CCACHE_NOHASHDIR=true xargs -P "$(nproc 2>/dev/null || echo 1)" -I{} \
        "${launcher[@]}" "$cc" "$@" -c {} -o "$dir/{}.o"
}
