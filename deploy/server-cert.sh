#!/bin/sh
# server-cert.sh DIR NAME: the server certificate of NAME, a service the mesh calls that is no
# caller of the mesh (redis: Redis; jaeger: Jaeger's OTLP collector), as NAME.crt and NAME.key
# (DNS names NAME and localhost, IP 127.0.0.1 for the in-container probes) from the CA in DIR
# (ca.crt, ca.key, as `python -m infermesh certs DIR` writes them); it has no role and no SPIFFE
# URI. A certificate from that CA valid for 7 more days is kept; delete NAME.crt (or run after a
# new CA) to issue it again. Docs: docs/DEPLOYING.md.
set -eu
dir=$1
name=$2
if [ -s "$dir/$name.crt" ] &&
  openssl verify -CAfile "$dir/ca.crt" "$dir/$name.crt" >/dev/null 2>&1 &&
  openssl x509 -checkend 604800 -noout -in "$dir/$name.crt" >/dev/null; then
  echo "$dir: $name.crt valid, kept"
  exit 0
fi
umask 077
extensions=$(mktemp)
trap 'rm -f "$extensions" "$dir/$name.csr"' EXIT
printf '%s\n' "subjectAltName=DNS:$name,DNS:localhost,IP:127.0.0.1" \
  "extendedKeyUsage=serverAuth" "keyUsage=critical,digitalSignature" >"$extensions"
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
  -keyout "$dir/.$name.key.tmp" -out "$dir/$name.csr" 2>/dev/null
serial=0x$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "$serial" -days 365 -sha256 -extfile "$extensions" -out "$dir/.$name.crt.tmp" 2>/dev/null
chmod 644 "$dir/.$name.crt.tmp"
# the key first: a reader seeing the new certificate finds its key
mv "$dir/.$name.key.tmp" "$dir/$name.key"
mv "$dir/.$name.crt.tmp" "$dir/$name.crt"
echo "$dir: wrote $name.crt, $name.key"
