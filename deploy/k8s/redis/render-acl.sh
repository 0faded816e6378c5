#!/bin/sh
# render-acl.sh RULES PASSWORD_DIR OUT: writes Redis's ACL file OUT from RULES (users.acl), with the
# SHA-256 of PASSWORD_DIR/<user> (the gateway's and the router's passwords; a trailing newline is
# not part of one) in place of each @<USER>_PASSWORD_SHA256@. Redis then holds hashes only; OUT is
# readable by its owner only.
set -eu
rules=$1 passwords=$2 out=$3
sha256() {
  password=$(cat "$passwords/$1")
  if [ -z "$password" ]; then
    echo "render-acl.sh: $passwords/$1 is empty" >&2
    return 1
  fi
  printf %s "$password" | sha256sum | cut -d' ' -f1
}
gateway=$(sha256 gateway)
router=$(sha256 router)
umask 077
grep -v '^#' "$rules" |
  sed -e "s/@GATEWAY_PASSWORD_SHA256@/$gateway/" -e "s/@ROUTER_PASSWORD_SHA256@/$router/" >"$out"
