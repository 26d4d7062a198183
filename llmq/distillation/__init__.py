"""Knowledge distillation: a student trained on a teacher's token distributions (`llmq distill`).

`loss`: the KD, cross-entropy and hidden-state losses (pure functions). `data`: the order in
which training windows are seen, a pure function of the step. `schedule`: the learning rate.
`masks`: zeros of a pruned student that stay zero. `parallel`: torchrun / DDP. `state`: the
training state an interrupted run resumes from. `loop`: the training loop. `models`: loading
teacher and student, checking their vocabularies, writing the student.
"""
