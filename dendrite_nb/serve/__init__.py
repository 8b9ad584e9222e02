"""The OpenAI-compatible HTTP server over a dendrite engine (issue 41): `python -m dendrite_nb serve MODEL` or
`%dendrite serve`. protocol.py holds the wire protocol (requests parsed, responses built), with no engine and
no HTTP framework in it."""
