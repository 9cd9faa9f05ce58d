"""TensorFlow ops: the lookup primitive (`lookup`), its row updates and the
tf.distribute helpers."""
