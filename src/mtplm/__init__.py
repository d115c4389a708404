"""mtplm: turn a pretrained causal LM into a multi-token predictor and measure what the speed costs.

Public entry points:
    MTPModel.load(spec)            a converted checkpoint (or a base model, for plain decoding)
    generate(model, prompt_ids, strategy, ...)   the decoding loop (see decode.py)
    make_strategy(DecodeConfig)    plain / static-k / ConfAdapt
    train(TrainConfig)             convert a model by online self-distillation
"""

__version__ = "0.1.0"
