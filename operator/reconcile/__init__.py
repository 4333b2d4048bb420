"""The reconcile pass: desired objects from a spec, applied to the cluster, and the status that reports them."""
