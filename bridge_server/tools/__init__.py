"""What runs at build or set-up time, never in a serving process: the binding documents' parser
(`seeds.py`), the Elixir binding generator (`elixir_gen.py`) and the offline tiny model (`tiny_model.py`).
"""
