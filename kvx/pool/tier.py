class PoolTier:  # placeholder replaced below
    pass
