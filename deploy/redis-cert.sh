#!/bin/sh
# redis-cert.sh DIR: Redis's server certificate (redis.crt, redis.key; DNS names redis and
# localhost, for the in-container probe) from the CA in DIR (ca.crt, ca.key, as
# `python -m infermesh certs DIR` writes them). Redis is no caller of the mesh, so it has no
# role and no SPIFFE URI. A certificate from that CA valid for 7 more days is kept; delete
# redis.crt (or run after a new CA) to issue it again. Docs: docs/DEPLOYING.md.
set -eu
dir=$1
if [ -s "$dir/redis.crt" ] &&
  openssl verify -CAfile "$dir/ca.crt" "$dir/redis.crt" >/dev/null 2>&1 &&
  openssl x509 -checkend 604800 -noout -in "$dir/redis.crt" >/dev/null; then
  echo "$dir: redis.crt valid, kept"
  exit 0
fi
umask 077
extensions=$(mktemp)
trap 'rm -f "$extensions" "$dir/redis.csr"' EXIT
printf '%s\n' "subjectAltName=DNS:redis,DNS:localhost,IP:127.0.0.1" \
  "extendedKeyUsage=serverAuth" "keyUsage=critical,digitalSignature" >"$extensions"
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=redis \
  -keyout "$dir/.redis.key.tmp" -out "$dir/redis.csr" 2>/dev/null
serial=0x$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
openssl x509 -req -in "$dir/redis.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "$serial" -days 365 -sha256 -extfile "$extensions" -out "$dir/.redis.crt.tmp" 2>/dev/null
chmod 644 "$dir/.redis.crt.tmp"
# the key first: a reader seeing the new certificate finds its key
mv "$dir/.redis.key.tmp" "$dir/redis.key"
mv "$dir/.redis.crt.tmp" "$dir/redis.crt"
echo "$dir: wrote redis.crt, redis.key"
