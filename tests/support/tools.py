"""The tools and conversations the tool-calling and reasoning tests share, in each API's
shape (chat completions, Responses, Anthropic), and the check of a weather call's arguments."""

from __future__ import annotations

WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object",
               "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
               "required": ["zone"], "additionalProperties": False}
WEATHER_ABOUT = "The current weather of a city."
TIME_ABOUT = "The time now in a time zone."

# chat completions (and Model.chat)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": WEATHER_ABOUT, "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": TIME_ABOUT, "parameters": TIME_PARAMS}}
# the Responses API's flat function tools
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": WEATHER_ABOUT,
                     "parameters": WEATHER_PARAMS}
# Anthropic's tools
ANTHROPIC_WEATHER = {"name": "get_weather", "description": WEATHER_ABOUT,
                     "input_schema": WEATHER_PARAMS}
ANTHROPIC_TIME = {"name": "get_time", "description": TIME_ABOUT, "input_schema": TIME_PARAMS}

ASK_WEATHER = "What is the weather in Paris?"

# Few-shot questions with a reasoning and an answer each, for the reasoning tests.
SHOTS = [("What is 2+2?", "Two plus two is four.", "4"),
         ("What is 3+3?", "Three plus three is six.", "6"),
         ("What is 1+1?", "One plus one is two.", "2")]


def weather_args_ok(name: str, args: dict) -> bool:
    """Whether a call is get_weather with arguments that match WEATHER_PARAMS."""
    return (name == "get_weather" and isinstance(args, dict) and set(args) == {"city", "unit"}
            and isinstance(args["city"], str) and len(args["city"]) <= 12
            and args["unit"] in ("c", "f"))
