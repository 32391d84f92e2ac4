"""A ZeRO-style training engine whose shards live on the device, in host memory or in a store.

Where things are
----------------
Lowest floor first; a module imports from its own floor and those below, never above
(``tests/test_code_shape.py`` checks it, and that no import goes round a circle).

- ``offload`` (a sibling package) moves bytes: host buffers, the I/O runner, the zarr shard
  store (striped across several folders by ``stripes``; its verbs on whole nodes in ``nodes``),
  its generations and commits; it never imports the engine.
- ``engine.config``: a run's ``Config`` with its checks and the rules several parts must agree
  on (``shares_master``, ``overlaps_backward``, ``spills_gradients``); its sections in
  ``engine.config_sections``, read from a file by ``engine.config_parse``. It imports nothing
  else of the engine.
- ``engine.runtime``: the machine: the device and its copy stream (and a simulated one for
  tests, ``detect`` choosing), the process group, device memory accounting, sizes, compiled
  kernels, the host optimizer worker, the process's peak RSS (``rss``).
- ``engine.state``: what a rank's training state is made of and how it is laid out, below both
  the tiers that hold it and the step that updates it: units and their flat layout and shards
  (``partition``), the optimizer state's kinds and forms (``forms``), the int8 block format
  (``quantize``) and the dtypes by name (``dtypes``).
- ``engine.tiers``: where a rank's shards live between uses: optimizer tiers (``optimizer``,
  ``optimizer_store`` with its checks and store modes), parameter tiers (``parameters``), the
  sizes they take (``sizing``), checkpoints of the memory tiers, the committed step record, the
  stores of several hosts (``hosts``) and gradients spilled during backward (``grad_spill``).
- ``engine.zero``: the ZeRO mechanics of one step, driving the tiers: gathering and releasing
  parameters (``params``, a stage-3 unit's own life cycle in ``unit_params``), gradient shards
  (``grads``), the step's control path (``step``: the update, spilled gradients, norms,
  clipping, the commit), its arithmetic (``step_math``, ``optim``; which parameters decay in
  ``decay``; the update of compact state in ``compact_update``), the unit-by-unit update over
  the optimizer tier (``update``), loss scaling (``precision``), the step cycle (``phase``) and
  what a step cost (``stats``).
- ``engine.engine``: ``Engine``, the user's object; ``engine.build`` puts one together from a
  ``Config``.
- ``engine.run``: ``python -m engine``: the training loop, data, validation, the step records
  (``watch``: metrics file and TensorBoard), the built-in GPT, pretrained imports, and
  ``generate`` (text from a run's store); its command line (``cli``) stands above
  ``engine.tools`` too, which it runs.
- ``engine.tools``: what works on a store, a plan or a run's records from outside a run:
  ``estimate``, ``inspect``, ``consolidate``, ``export`` (``merge`` for LoRA), ``gather``, ``plot``.

Words, each with one meaning
----------------------------
- *unit*: the grain of sharding, communication and I/O (by default a block of an
  ``nn.ModuleList``, plus the ``root`` unit); *layout*: every unit's flat buffer and shards.
- *shard*: one rank's equal slice of a unit's flat buffer; *master*: the shard the optimizer
  updates (fp32, or bf16 with ``optim.master_dtype``); the *state kinds* are master, exp_avg
  and exp_avg_sq.
- *frozen unit*: a unit's parameters with ``requires_grad=False`` (``<unit>.frozen``): held and
  gathered like any unit, with no gradient and no state kinds; a store keeps its values once
  (``engine.tiers.frozen``).
- *tier*: where shards live between uses: ``device``, ``cpu`` or ``nvme`` (a store).
- *stripe*: a store's chunks spread across several folders, one per drive (``offload.nvme_path``
  a list); the first folder is the store, the others hold shares of its chunks.
- *generation*: one complete copy of the optimizer state in a store; *commit*: make a step's
  generation the one a run resumes from; *checkpoint*: a committed step kept under a tag.
- *stream*: only a device's queue of work (the compute stream, the copy stream). Reading
  shards ahead of their use is a *read-ahead* (``offload.Pipeline.read_ahead``).

Every tier goes through the same lifecycle verbs:

- ``add``: take a unit's initial values before the first step;
- ``read``: start bringing a unit's state into memory ahead of its use;
- ``write_back``: hand back a unit's updated values, stored behind the update;
- ``commit``: the step's written-back state becomes what a run resumes from (optimizer tiers);
- ``flush``: complete what was left running in the background (a deferred commit, writes);
- ``save``: keep the committed state as a checkpoint;
- ``discard_step``: give up the step in progress, never committing it;
- ``take_io_bytes``: disk bytes moved since the last call (and reset the count);
- ``close``: complete what is pending and release what the tier holds.

On the device, stage 3 *gathers* a unit's parameters before its forward or backward and
*releases* them after.
"""
