"""mtplm: turn a pretrained causal LM into a multi-token predictor and measure what the speed costs.

Entry points (the README's Python example uses them):
    mtplm.model.load_model(spec, dtype)        a shipped or converted checkpoint, a registry name or an HF dir
    mtplm.config.parse_mode(spec)              a mode string such as "verified:lookup" -> DecodeConfig
    mtplm.decode.passes.backends.make_backend(name, model)   the pass every step runs (auto, eager, compiled)
    mtplm.decode.generate(model, ids, cfg, backend=...)   the decoding loop, every mode
    mtplm.train.trainer.train(TrainConfig)     convert a model by online self-distillation
The command line is `mtplm` (mtplm.cli).
"""

__version__ = "0.1.0"
