// placeholder until the optimizer facade lands
