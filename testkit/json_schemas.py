"""A shared set of constraints for structured-output tests and benchmarks.

`SCHEMAS` maps a name to a JSON schema (Draft 2020-12, each one satisfiable); together they
cover the features a JSON-schema-constrained decoder has to handle: nested objects, bounded
arrays, enum/const, numeric bounds (incl. exclusive ones), nullable and optional fields,
`$ref`/`$defs` (also recursive), `anyOf`/`oneOf`, string patterns, lengths and formats,
`additionalProperties`, `prefixItems`, plus two realistic shapes ("image_description" and
"nested_invoice").  `EXAMPLES` holds one hand-written valid instance per schema (for driving a
grammar matcher through real tokens, or as a test oracle), `REGEXES` a few regex constraints
and `CHOICES` a few choice lists.

Nothing here imports a grammar library; `benchmarks/grammar_libraries.py` measures
llguidance and xgrammar on this set.
"""

from __future__ import annotations

from typing import Any

JsonSchema = dict[str, Any]

_POINT: JsonSchema = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, JsonSchema] = {
    "simple_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "street": {"type": "string"},
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["street", "city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 5}
        },
        "required": ["tags"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1}, "label": {"type": "string"}},
            "required": ["id", "label"],
            "additionalProperties": False,
        },
        "minItems": 2,
        "maxItems": 4,
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["matrix"],
    },
    "enum_string": {
        "type": "object",
        "properties": {"status": {"enum": ["pending", "running", "done", "failed"]}},
        "required": ["status"],
    },
    "enum_mixed": {
        "type": "object",
        "properties": {"value": {"enum": [1, "two", None, True, 3.5]}},
        "required": ["value"],
    },
    "const_fields": {
        "type": "object",
        "properties": {
            "version": {"const": "1.0"},
            "kind": {"const": "event"},
            "payload": {"type": "string"},
        },
        "required": ["version", "kind", "payload"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["temperature", "count", "ratio"],
    },
    "integer_pagination": {
        "type": "object",
        "properties": {
            "page": {"type": "integer", "minimum": 1},
            "per_page": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        "required": ["page", "per_page"],
        "additionalProperties": False,
    },
    "nullable_fields": {
        "type": "object",
        "properties": {
            "first_name": {"type": "string"},
            "middle_name": {"type": ["string", "null"]},
            "age": {"type": ["integer", "null"], "minimum": 0},
        },
        "required": ["first_name", "middle_name", "age"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "subtitle": {"type": "string"},
            "year": {"type": "integer"},
            "draft": {"type": "boolean"},
        },
        "required": ["title"],
    },
    "booleans": {
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "visible": {"type": "boolean"},
            "archived": {"type": "boolean"},
        },
        "required": ["enabled", "visible", "archived"],
    },
    "closed_object": {
        "type": "object",
        "properties": {"key": {"type": "string"}, "value": {"type": "integer"}},
        "required": ["key", "value"],
        "additionalProperties": False,
    },
    "string_map": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0},
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        },
        "required": ["sku", "color"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {
            "username": {"type": "string", "minLength": 3, "maxLength": 16},
            "bio": {"type": "string", "maxLength": 80},
            "code": {"type": "string", "minLength": 4, "maxLength": 4},
        },
        "required": ["username", "bio", "code"],
    },
    "string_formats": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "created": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["id", "created", "day", "email"],
    },
    "ref_defs": {
        "type": "object",
        "$defs": {"point": _POINT},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "bounded_tree": {
        # Recursive-ish but bounded: each level refers to the next, the last one is a leaf.
        "type": "object",
        "$defs": {
            "leaf": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            "mid": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3},
                },
                "required": ["name", "children"],
            },
        },
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/mid"}, "maxItems": 3},
        },
        "required": ["name", "children"],
    },
    "recursive_tree": {
        # Truly recursive $ref; instances are finite because `children` may be empty.
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["value", "children"],
                "additionalProperties": False,
            }
        },
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "number"},
                    {"type": "object", "properties": {"unit": {"type": "string"}}, "required": ["unit"]},
                ]
            }
        },
        "required": ["value"],
    },
    "one_of_shapes": {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
                        "required": ["kind", "radius"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "rect"},
                            "w": {"type": "number", "minimum": 0},
                            "h": {"type": "number", "minimum": 0},
                        },
                        "required": ["kind", "w", "h"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}],
        "items": False,
    },
    "any_json_object": {"type": "object"},
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search"]},
            "arguments": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                        "required": ["city", "unit"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}},
                        "required": ["query"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
    "image_description": {
        "type": "object",
        "properties": {
            "caption": {"type": "string"},
            "objects": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string"},
                        "count": {"type": "integer", "minimum": 1},
                        "bbox": {
                            "type": "array",
                            "items": {"type": "number", "minimum": 0, "maximum": 1},
                            "minItems": 4,
                            "maxItems": 4,
                        },
                    },
                    "required": ["label", "count"],
                },
                "maxItems": 10,
            },
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "orange", "yellow", "green", "blue", "purple", "black", "white", "gray"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "has_text": {"type": "boolean"},
            "text": {"type": ["string", "null"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["caption", "objects", "colors", "has_text", "text", "confidence"],
        "additionalProperties": False,
    },
    "ocr_regions": {
        "type": "object",
        "$defs": {
            "box": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 4096},
                "minItems": 4,
                "maxItems": 4,
            }
        },
        "properties": {
            "language": {"enum": ["en", "de", "fr", "zh", "ja"]},
            "regions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"text": {"type": "string"}, "box": {"$ref": "#/$defs/box"}},
                    "required": ["text", "box"],
                    "additionalProperties": False,
                },
                "minItems": 1,
            },
        },
        "required": ["language", "regions"],
    },
    "nested_invoice": {
        "type": "object",
        "$defs": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "country": {"enum": ["US", "DE", "FR", "GB", "JP"]},
                },
                "required": ["street", "city", "postal_code", "country"],
                "additionalProperties": False,
            },
            "line_item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "description": {"type": "string", "maxLength": 60},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tax_rate": {"enum": [0, 0.07, 0.19]},
                },
                "required": ["sku", "description", "quantity", "unit_price", "tax_rate"],
                "additionalProperties": False,
            },
        },
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "issued": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
            "seller": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
                "required": ["name", "address"],
                "additionalProperties": False,
            },
            "buyer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "email": {"type": ["string", "null"]},
                    "address": {"$ref": "#/$defs/address"},
                },
                "required": ["name", "email", "address"],
                "additionalProperties": False,
            },
            "items": {"type": "array", "items": {"$ref": "#/$defs/line_item"}, "minItems": 1, "maxItems": 20},
            "totals": {
                "type": "object",
                "properties": {
                    "subtotal": {"type": "number", "minimum": 0},
                    "tax": {"type": "number", "minimum": 0},
                    "total": {"type": "number", "exclusiveMinimum": 0},
                },
                "required": ["subtotal", "tax", "total"],
                "additionalProperties": False,
            },
            "paid": {"type": "boolean"},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["invoice_id", "issued", "currency", "seller", "buyer", "items", "totals", "paid"],
        "additionalProperties": False,
    },
}

_ADDRESS_DE = {"street": "Hauptstrasse 5", "city": "Berlin", "postal_code": "10115", "country": "DE"}

# One valid instance per schema (checked against SCHEMAS with jsonschema by the benchmark).
EXAMPLES: dict[str, Any] = {
    "simple_object": {"name": "Ada Lovelace", "age": 36},
    "nested_object": {
        "user": {"name": "Bob", "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}}
    },
    "bounded_array": {"tags": ["cat", "outdoor", "sunny"]},
    "array_of_objects": [{"id": 1, "label": "first"}, {"id": 2, "label": "second"}],
    "nested_arrays": {"matrix": [[1, 2, 3], [4, 5, 6]]},
    "enum_string": {"status": "running"},
    "enum_mixed": {"value": "two"},
    "const_fields": {"version": "1.0", "kind": "event", "payload": "user signed in"},
    "number_ranges": {"temperature": 21.5, "count": 7, "ratio": 0.25},
    "integer_pagination": {"page": 3, "per_page": 50},
    "nullable_fields": {"first_name": "Grace", "middle_name": None, "age": 85},
    "optional_fields": {"title": "Structured decoding", "year": 2025},
    "booleans": {"enabled": True, "visible": False, "archived": False},
    "closed_object": {"key": "retries", "value": 3},
    "string_map": {"apples": 3, "pears": 0, "plums": 12},
    "string_pattern": {"sku": "ABC-1234", "color": "#1a2b3c"},
    "string_lengths": {"username": "grace_h", "bio": "Computer scientist.", "code": "X9Z2"},
    "string_formats": {
        "id": "123e4567-e89b-12d3-a456-426614174000",
        "created": "2024-05-01T12:30:00Z",
        "day": "2024-05-01",
        "email": "ada@example.com",
    },
    "ref_defs": {"start": {"x": 0, "y": 1.5}, "end": {"x": 10, "y": -2}},
    "bounded_tree": {
        "name": "root",
        "children": [{"name": "a", "children": [{"name": "a1"}, {"name": "a2"}]}, {"name": "b", "children": []}],
    },
    "recursive_tree": {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}]},
    "any_of": {"value": {"unit": "kg"}},
    "one_of_shapes": {"shape": {"kind": "rect", "w": 3, "h": 4.5}},
    "tuple_prefix_items": ["width", 640, True],
    "any_json_object": {"model": "smollm2", "layers": 30, "tags": ["small", "fast"], "extra": None},
    "tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
    "image_description": {
        "caption": "A red bicycle leaning against a white wall next to a potted plant.",
        "objects": [
            {"label": "bicycle", "count": 1, "bbox": [0.12, 0.3, 0.65, 0.92]},
            {"label": "potted plant", "count": 1, "bbox": [0.7, 0.55, 0.88, 0.95]},
        ],
        "colors": ["red", "white", "green"],
        "has_text": False,
        "text": None,
        "confidence": 0.87,
    },
    "ocr_regions": {
        "language": "en",
        "regions": [{"text": "OPEN", "box": [10, 20, 110, 60]}, {"text": "9am - 5pm", "box": [12, 70, 140, 95]}],
    },
    "nested_invoice": {
        "invoice_id": "INV-004217",
        "issued": "2024-11-03",
        "currency": "EUR",
        "seller": {"name": "Acme GmbH", "address": _ADDRESS_DE},
        "buyer": {
            "name": "Jane Doe",
            "email": "jane@example.com",
            "address": {"street": "12 Rue de Rivoli", "city": "Paris", "postal_code": "75001", "country": "FR"},
        },
        "items": [
            {"sku": "WID-0001", "description": "Widget, large", "quantity": 4, "unit_price": 12.5, "tax_rate": 0.19},
            {"sku": "GAD-0420", "description": "Gadget", "quantity": 1, "unit_price": 99.99, "tax_rate": 0.19},
            {"sku": "SRV-1000", "description": "Installation service", "quantity": 2, "unit_price": 40, "tax_rate": 0},
        ],
        "totals": {"subtotal": 229.99, "tax": 28.5, "total": 258.49},
        "paid": False,
        "notes": None,
    },
}

REGEXES: dict[str, str] = {
    "iso_date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "iso_time": r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?",
    "us_phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "hex_colour": r"#[0-9a-fA-F]{6}",
    "word_list": r"[a-z]+(, [a-z]+){0,4}",
    "yes_no_reason": r"(yes|no): [A-Za-z ]{1,40}\.",
}

CHOICES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "yes_no": ["yes", "no"],
    "scene": ["indoor", "outdoor", "underwater", "aerial", "unknown"],
}


# Two OpenAI tool definitions for the tool-call tests (a bounded city name keeps noise short).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
