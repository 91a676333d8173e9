"""Tool calling on the OpenAI chat API: the tools a request offers and how it lets the model call
them (request.py), how the prompt shows them (rendering.py), the text formats models write calls in
(one module per family: hermes.py, llama3_json.py, mistral.py, and forced.py for calls a grammar
forces), which format a model uses (choice.py), and reading calls out of generated text as it
streams (reader.py)."""
