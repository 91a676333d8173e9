"""Hermes-style calls, as Qwen2.5/Qwen3, Hermes 2/3 and the templates Tandem renders tools into write
them: each call a JSON object in its own `<tool_call>` ... `</tool_call>` tags, anywhere in the
text (text before, between and after them is content):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from .format import CallFormat, Layout, Opener

FORMAT = CallFormat("hermes", (Opener("<tool_call>", Layout(close="</tool_call>")),))
