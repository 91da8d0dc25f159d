"""JSON schemas shared by the structured-output tests (server, sampler, GPU)."""

CARD_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["ok", "name", "color", "count", "tags"],
    "additionalProperties": False,
}
