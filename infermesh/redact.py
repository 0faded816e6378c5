"""URLs as logs and error messages may show them: never with the credentials they carry."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode

_HIDDEN = "***"
# query parameters that carry a credential (a Redis URL's password, a token in a link)
_SECRET_PARAMETERS = ("password", "token", "secret", "key")
# a URL inside a text (an error's message names the URL it was given)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """``url`` with the password of its user info and the values of credential-like query
    parameters replaced by ``***`` (``rediss://gateway:***@redis:6379/0``); the rest as given,
    so the URL still says where it points. Several hosts (``redis+cluster://a:1,b:2``) and
    URLs without a scheme are handled alike."""
    scheme, separator, rest = url.partition("://") if "://" in url else ("", "", url)
    location, slash, path = rest.partition("/")
    user_info, at, hosts = location.rpartition("@")
    if at:
        user, colon, _ = user_info.partition(":")
        location = f"{user}:{_HIDDEN}@{hosts}" if colon else f"{_HIDDEN}@{hosts}"
    path, question, query = path.partition("?")
    if question:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [
                (k, _HIDDEN if any(s in k.lower() for s in _SECRET_PARAMETERS) else v)
                for k, v in pairs
            ],
            safe="/*",
        )
    return f"{scheme}{separator}{location}{slash}{path}{question}{query}"


def redact_urls_in(text: str) -> str:
    """``text`` with every URL in it redacted (``redact_url``)."""
    return _URL.sub(lambda match: redact_url(match.group()), text)
