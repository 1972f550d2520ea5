"""What a module keeps of its last forward inside that forward's graph (the aux loss, the router
logits), held apart so that `copy.deepcopy(module)` works after a forward: autograd refuses to copy a
tensor inside a graph, and a copy, like a new module, has run no forward."""


class LastForward(dict):
    def __deepcopy__(self, memo):
        return LastForward()


class from_last_forward:
    """A module attribute (None until set) held in the module's LastForward."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        return module.__dict__.get("_last_forward", {}).get(self.name)

    def __set__(self, module, value):
        module.__dict__.setdefault("_last_forward", LastForward())[self.name] = value
