"""The tuner: a pure control law from pool metrics to knob and replica decisions, and one run around it.
No kopf and no Kubernetes client here: the operator, the local fleet and the simulator all call it."""
