"""What a training process does around the train step itself: watching device work for hangs
(``watchdog``)."""
