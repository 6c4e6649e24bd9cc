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
