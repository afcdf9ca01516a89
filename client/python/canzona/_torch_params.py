"""The forms of canzona.torch's first argument: what ``torch.optim``
takes (parameters, or param groups as dicts) besides the (name, parameter)
pairs of ``model.named_parameters()``.

The daemon needs a name per parameter: names key its checkpoints (so that
they load into any layout) and, in ``Muon`` / ``Shampoo`` / ``SOAP``, send
embeddings and output heads to AdamW. Parameters without one are named
after ``module=``, or by position ("params.<group>.<index>", as
torch.optim's state_dict keys them) where their optimizer is known without
a name; a param group (a dict) becomes one group of the daemon's with its
own settings, as a group of ``torch.optim`` does.
"""

import collections.abc

import torch

from canzona._torch_setup import _SETTINGS, _daemon_spelling

# Keys of a param group dict that are not settings.
_GROUP_KEYS = ("params", "name", "optimizer")


def _pairs(params, where, names, positional):
    """(name, parameter) pairs of one iterable of parameters or pairs;
    ``names``: {id(parameter): name} of ``module=``, or None; without it
    a parameter is named "<positional>.<index>" where ``positional`` is
    given (its optimizer is known without a name), else refused."""
    if isinstance(params, torch.Tensor):
        params = [params]
    named = []
    for j, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            if names is None:
                if positional is None:
                    raise ValueError(
                        "%s: a parameter without a name, and its optimizer "
                        "is chosen by name (embeddings and lm_head go to "
                        "AdamW): pass model.named_parameters(), or "
                        "module=model (which names them), or param groups "
                        "that each say their 'optimizer'" % where)
                named.append(("%s.%d" % (positional, j), item))
                continue
            if id(item) not in names:
                raise ValueError(
                    "%s: a parameter of shape %s that module= does not hold"
                    % (where, tuple(item.shape)))
            named.append((names[id(item)], item))
        elif (isinstance(item, tuple) and len(item) == 2 and
              isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            named.append(item)
        else:
            raise TypeError(
                "%s: %s is not a parameter or a (name, parameter) pair"
                % (where, type(item).__name__))
    return named


def parameters_argument(params, groups, route, module, kind_of=None,
                        defaults=None):
    """(named, groups, route) for Optimizer from its first argument.

    Pairs or parameters: ``groups`` and ``route`` stay as given. Dicts
    (torch.optim param groups): one group each, named by its "name" (else
    its optimizer, with the dict's index where that repeats); its optimizer
    is its "optimizer", else ``kind_of(name, param)`` of its parameters,
    which must agree; its settings are ``defaults[kind]`` updated with the
    dict's other keys (torch's spelling: "betas")."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params: an iterable of parameters, (name, parameter) "
                        "pairs or param group dicts, not one tensor (as "
                        "torch.optim)")
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            "params: the module %s itself; pass its named_parameters() "
            "(and pass it as module= for the overlap)"
            % type(params).__name__)
    if isinstance(params, collections.abc.Mapping):
        # {name: parameter}, as dict(model.named_parameters()) makes; a
        # state_dict() holds tensors detached from the model instead.
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) and
                   v.requires_grad for k, v in params.items()):
            raise TypeError(
                "params: a mapping, but not of names to parameters (a "
                "state_dict() holds tensors detached from the model): pass "
                "model.named_parameters()")
        params = list(params.items())
    items = list(params)
    names = None
    if module is not None:
        names = {id(p): n for n, p in module.named_parameters()}
    if not any(isinstance(item, dict) for item in items):
        # One group of Optimizer's needs no name to route by.
        single = kind_of is None and route is None
        return (_pairs(items, "params", names, "params" if single else None),
                groups, route)
    if not all(isinstance(item, dict) for item in items):
        raise TypeError("params: param group dicts mixed with parameters")
    if groups is not None or route is not None:
        raise ValueError("params: param group dicts say each group's "
                         "settings; groups= and route= are for "
                         "named_parameters()")
    named, parsed, routed = [], {}, {}
    for i, group in enumerate(items):
        where = "params[%d]" % i
        if "params" not in group:
            raise ValueError("%s: no 'params'" % where)
        kind = group.get("optimizer")
        pairs = _pairs(group["params"], where + "['params']", names,
                       None if kind is None else "params.%d" % i)
        if not pairs:
            raise ValueError("%s['params']: empty" % where)
        if kind is None:
            if kind_of is None:
                raise ValueError("%s: 'optimizer' is needed (one of %s)"
                                 % (where, ", ".join(sorted(_SETTINGS))))
            by_kind = {}
            for name, param in pairs:
                by_kind.setdefault(kind_of(name, param), []).append(name)
            if len(by_kind) > 1:
                raise ValueError(
                    "%s holds %s: a group has one optimizer; split it, or "
                    "give it 'optimizer'" % (where, " and ".join(
                        "%s parameters (%s)" % (k, ", ".join(v[:3]))
                        for k, v in sorted(by_kind.items()))))
            kind = next(iter(by_kind))
        gname = group.get("name")
        if gname is None:
            gname = kind if kind not in parsed else "%s_%d" % (kind, i)
        if gname in parsed:
            raise ValueError("%s: group name %r is taken" % (where, gname))
        settings = {k: v for k, v in group.items() if k not in _GROUP_KEYS}
        spec = dict((defaults or {}).get(kind, {}))
        spec.update(_daemon_spelling(gname, settings))
        spec["optimizer"] = kind
        parsed[gname] = spec
        for name, _ in pairs:
            if name in routed:
                raise ValueError("%s: parameter %r is in two groups"
                                 % (where, name))
            routed[name] = gname
        named.extend(pairs)
    return named, parsed, routed
