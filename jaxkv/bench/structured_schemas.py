"""JSON schemas for `jaxkv bench structured`, held out: written for the benchmark and never
used by the tests (tests/test_structured.py and tests/test_server_structured.py have their
own), covering what real schemas use: nesting, arrays with bounds, enums, numbers with ranges,
optional and required properties, formats and patterns, $ref/$defs, anyOf, nullable fields."""

HELD_OUT = {
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "author": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "genres": {"type": "array", "items": {"type": "string", "maxLength": 20},
                       "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "author", "year"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "celsius": {"type": "number", "minimum": -60, "maximum": 60},
            "sky": {"enum": ["clear", "cloudy", "rain", "snow", "fog"]},
            "wind_kmh": {"type": ["integer", "null"], "minimum": 0, "maximum": 300},
        },
        "required": ["city", "celsius", "sky"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "items": {"type": "array", "maxItems": 4, "items": {"$ref": "#/$defs/line"}},
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
        "additionalProperties": False,
        "$defs": {"line": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "contact": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "reach": {"anyOf": [
                {"type": "object", "properties": {"email": {"type": "string", "maxLength": 40}},
                 "required": ["email"], "additionalProperties": False},
                {"type": "object", "properties": {"phone": {"type": "string",
                                                            "pattern": "^[0-9 +-]{7,15}$"}},
                 "required": ["phone"], "additionalProperties": False}]},
        },
        "required": ["name", "reach"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
            "online": {"type": "boolean"},
        },
        "required": ["name", "date"],
        "additionalProperties": False,
    },
    "classification": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    "tree": {
        "type": "object",
        "properties": {
            "value": {"type": "integer", "minimum": 0, "maximum": 9},
            "children": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["value"], "additionalProperties": False}},
        },
        "required": ["value", "children"],
        "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {
            "dish": {"type": "string", "maxLength": 40},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 60},
                      "minItems": 1, "maxItems": 3},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["dish", "minutes", "steps"],
        "additionalProperties": False,
    },
}

# Extraction: a record in the prompt, its fields asked for as JSON. The values are copied from
# the prompt, which is where n-gram speculation finds its drafts.
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"product": {"type": "string", "maxLength": 50},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["product", "quantity"], "additionalProperties": False}},
    },
    "required": ["customer", "email", "city", "items"],
    "additionalProperties": False,
}
EXTRACTION_RECORDS = [
    "Order 5531 was placed by Marguerite Okonkwo-Baptiste (marguerite.okonkwo@example.org), "
    "shipping to Villeneuve-sur-Lot. She ordered 3 x Stainless steel pour-over kettle and "
    "2 x Unbleached paper filters, pack of 100.",
    "Customer Tobias Lindqvist-Hargreave, email tobias.lindqvist@example.net, lives in "
    "Kristiansand. The basket holds 1 x Ergonomic split keyboard with brown switches, "
    "4 x USB-C braided cable, two metres, and 1 x Aluminium laptop stand.",
    "Ship to Ponta Delgada for Inês Vasconcelos-Amaral (ines.vasconcelos@example.com): "
    "6 x Organic green tea sencha, 50 g tin, and 2 x Cast iron teapot with infuser.",
]
