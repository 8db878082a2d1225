"""simulations: the simulated world that runs p2pnet's pure protocol cores in virtual time.

It owns the discrete-event engine, the modeled network (latency, bandwidth, loss, partitions,
churn), scenarios, experiments, tables and plots. It must not reimplement protocol logic: it
drives the same cores (`p2pnet.peertable`, relay planning and transfer, validator assignment)
as the real peer does.
"""
