from django.db import models


class Order(models.Model):
    customer = models.TextField()
    amount = models.IntegerField()

    class Meta:
        app_label = "shop"
