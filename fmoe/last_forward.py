"""What a module keeps of its last forward inside that forward's graph (the aux loss, the router
logits) is left behind by `copy.deepcopy(module)`: autograd refuses to copy a tensor inside a graph,
and a copy, like a new module, has run no forward. Plain attributes in the forward (a descriptor
there breaks Dynamo before torch 2.5); the copy is where they are dropped."""
import copy


class ForgetsLastForward:
    """A module mixin: `last_forward_attrs` name the attributes a deep copy sets to None."""

    last_forward_attrs: tuple = ()

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = None if key in self.last_forward_attrs else copy.deepcopy(value, memo)
        return new
