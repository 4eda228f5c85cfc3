"""placeholder"""
def run_from_config(cfg):
    raise NotImplementedError("trainer not implemented yet")
